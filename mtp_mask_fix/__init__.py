"""Carried fix for Megatron-Bridge #6103: check, apply, verify and revert the patch on any Megatron-Bridge; watch any
megatron-core job's MTP loss."""

__version__ = "0.2.0"
