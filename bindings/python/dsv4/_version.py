"""The package's version: the library version whose C header this binding is written against
(read without importing the package by the build backend, see pyproject.toml; tests check it
against Cargo.toml)."""

__version__ = "0.1.0"
