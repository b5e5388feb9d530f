"""The policy: AdaptivePolicy, its float8 entries, the layers it controls, its .keras form."""
