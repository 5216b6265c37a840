"""Recipes: complete training jobs built on the library, kept apart from it.

A recipe may import anything in ``lightning_pipe2bw``; nothing in the library imports a recipe
(``tests/unit/test_layering.py`` checks). The main job is :mod:`lightning_pipe2bw.recipes.gpt`.
"""
