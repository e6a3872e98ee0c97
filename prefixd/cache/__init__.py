"""prefixd.cache (see DESIGN.md)."""
