"""The tutorial notebooks; `python -m tutorials.execute` stores their outputs."""
