"""A toy third-party facet-recipe distribution (see README.md). Importing the package loads
no recipe; the plugin hook does, on first facet use."""
