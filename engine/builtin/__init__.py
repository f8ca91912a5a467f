"""The built-in models' artifacts (tiny-gpt2/, tiny-gpt2-draft/, tiny-llama/, tiny-moe/) and the code that
made them: the corpus builder and the training program (``python -m engine.builtin.train MODEL``).
Nothing here runs at inference time."""
