"""Adapters for training stacks (see ``docs/integrations.md``; a page per stack in ``docs/integrations/``).

Each submodule imports its framework when it is itself imported, and only
then: ``import ckptstore`` and this package import none of them. A
submodule whose framework is missing raises ``ImportError`` naming the
extra to install (``pip install 'ckptstore[integrations]'``).
"""
