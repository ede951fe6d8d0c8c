"""Example vrl plugin: reverse a word."""
