"""The ``keras-mp`` command (:func:`main`: ``info``, ``demo``, ``bench``,
``export``) and the demonstrations it runs (:mod:`keras_mp.cli.demo`,
:mod:`keras_mp.cli.deploy_demo`)."""

from keras_mp.cli.command import main

__all__ = ["main"]
