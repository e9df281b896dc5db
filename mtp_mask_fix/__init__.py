"""The carried fix for Megatron-Bridge #6103, and a watch on any megatron-core job's MTP loss."""

__version__ = "0.2.0"
