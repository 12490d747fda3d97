"""kubetrt.serving"""
