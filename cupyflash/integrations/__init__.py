"""Integrations with the libraries attention is called from (each imports its library only when
used): ``cupyflash.integrations.transformers``."""
