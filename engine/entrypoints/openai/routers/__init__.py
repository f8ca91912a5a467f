"""FastAPI routers, one per concern. ``engine.entrypoints.openai.app.build_app`` includes them."""
