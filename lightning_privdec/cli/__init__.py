"""Command-line tools of lightning_privdec (``privdec-account``)."""
