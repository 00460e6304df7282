"""Layouts: every op's and every source tensor's layout on one mesh (the intra-op search)."""
