"""The user's inputs: ``model.py`` (the model, its batches and metric; the training half), how a batch calls the
model, and whether a tune fits the device: all checked before the expensive stages run.
"""
