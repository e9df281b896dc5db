"""What the bug costs the MTP head: the reproduction and the effect experiment (not part of the tool)."""
