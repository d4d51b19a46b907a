"""The configuration: every setting declared once (``fields``), validated (``settings``),
the config file's tables (``tables``), the source registry (``registry``) and the one
loader that combines the file, the environment and the flags (``loader.load_config``).

This package's ``__init__`` imports nothing, so the parts that are plain data (``fields``,
``registry``) stay cheap to read: the command line's parser and help use them without
importing pydantic or any source.
"""
