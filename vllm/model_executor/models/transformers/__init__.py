"""placeholder"""
X = 1
