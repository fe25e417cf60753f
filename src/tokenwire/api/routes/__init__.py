"""HTTP routers, one module per endpoint family."""
