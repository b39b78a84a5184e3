"""User input -> a typed, validated request: the merge spec (mergekit YAML), budgets, sizes, parameter settings and the environment. Validated once; nothing below re-parses it."""
