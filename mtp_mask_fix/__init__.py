"""Carried fix for Megatron-Bridge #6103: check, apply and gate the patch; prepare the PR."""
