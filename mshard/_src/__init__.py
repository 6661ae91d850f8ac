"""mshard's implementation, in layers (docs/architecture.md); import the public names from ``mshard`` and its public
sub-packages instead. Each folder is one layer and imports only from the folders below it:
``values`` < ``jaxpr`` < ``planning`` < ``runtime`` < ``frontend`` < ``training`` < ``edges``."""
