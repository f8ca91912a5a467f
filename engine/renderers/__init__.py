"""The API server's renderers: prompts become token ids before the engine sees them."""
