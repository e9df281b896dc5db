"""This repo's upkeep, never installed with the tool: the view src/ (`./run view`), the patch as a commit on a branch
of an upstream checkout (`./run branch`) and patches/ rewritten from it (`./run refresh`). Each writes this checkout
or serves only this repo's patch queue, so they run only from it."""
