"""The built-in models' artifacts (tiny-gpt2/) and the code that made them: the corpus builder and the
training script (``python -m engine.builtin.train_tiny_gpt2``). Nothing here runs at inference time."""
