"""kubetrt.operators"""
