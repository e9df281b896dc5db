"""This repo's upkeep, never installed with the tool: the view src/ (`./run view`) and the patches/ files rewritten
from where they come from (`./run refresh`). They write this checkout, so they run only from it."""
