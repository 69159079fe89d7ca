"""The test suite: a package, so pytest puts the repository root on sys.path
(``tests.helpers``, ``convert.make_checkpoint``) however it is started."""
