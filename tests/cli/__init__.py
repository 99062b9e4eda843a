"""The `overlap` command and the project around it: the cli, the bench suite, the demo, facts, the package, its
layers and its docs."""
