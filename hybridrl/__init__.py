"""hybridrl"""
