"""prefixd.kernels (see DESIGN.md)."""
