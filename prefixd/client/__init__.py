"""Client library (arrives with the daemon). Imports only prefixd.api and prefixd.kernels."""
