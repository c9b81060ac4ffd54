"""The language front end: syntax tree, parser, printer, formatter, definitions, checker,
``.attn`` libraries and the pattern registry. Pure Python: no torch (only the parser imports lark,
only the registry reads YAML)."""
