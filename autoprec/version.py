"""The version of autoprec, in one leaf module that every stage may import."""

__version__ = "0.1.0"
