"""The error the PostgreSQL adapter raises for a vectorizer it cannot create or change as asked."""

from __future__ import annotations


class VectorizerError(ValueError):
    """A vectorizer that cannot be created or changed as asked; the message names the input."""
