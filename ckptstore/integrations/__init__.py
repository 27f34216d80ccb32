"""Adapters for training stacks (DeepSpeed, Megatron-Core, Hugging Face, Lightning).

Each submodule imports its framework when it is imported and raises an
``ImportError`` naming the extra (``pip install 'ckptstore[integrations]'``)
when the framework is missing; importing this package imports none of them.
"""
