"""The "mok" experts backend for Hugging Face transformers (filled by the transformers integration)."""


def register_if_installed() -> None:
    return None
