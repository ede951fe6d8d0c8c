"""Example vrl plugin: a random-search update rule and a canned-completions generator backend."""
