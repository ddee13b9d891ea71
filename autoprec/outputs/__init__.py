"""Outputs: the output folder of a run, what a tune returns, and the report (tables, Markdown, plots).
"""
