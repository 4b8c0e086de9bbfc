"""The `kconvert` command line (click + rich). Thin: each command calls one library function."""
