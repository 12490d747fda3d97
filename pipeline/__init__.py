"""kubetrt.pipeline"""
