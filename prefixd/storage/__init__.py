"""prefixd.storage (see DESIGN.md)."""
