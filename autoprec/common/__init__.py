"""What every layer of autoprec shares: standard JSON, how numbers and tables are written, the SQNR measure,
reading a number from /proc.
"""
