"""FastAPI routers, one per concern. ``engine.server.app.build_app`` includes them."""
