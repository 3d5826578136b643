"""Model integrations (transformers, Megatron-Core). Optional dependencies are imported only where used."""


def register_on_import() -> None:
    """Called by `import mok_inductor`: registers the "mok" experts backend with transformers when it is
    installed (that name is the only thing touched at import)."""
    from . import transformers as _hf

    _hf.register_if_installed()
