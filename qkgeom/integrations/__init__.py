"""Callbacks that put qkgeom.Probe into other people's training loops, each an optional extra that
the core never imports:

    qkgeom.integrations.transformers.QKGeometryCallback   pip install 'qkgeom[transformers]'
    qkgeom.integrations.lightning.QKGeometryCallback      pip install 'qkgeom[lightning]'
"""
