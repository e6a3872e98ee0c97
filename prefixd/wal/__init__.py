"""prefixd.wal (see DESIGN.md)."""
