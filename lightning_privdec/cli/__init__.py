"""Command-line tools of lightning_privdec: ``privdec-account`` (privacy accountants) and ``privdec-audit``
(empirical lower bounds on epsilon from canaries)."""
