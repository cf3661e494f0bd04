"""The client's cached function sources (`vlenvoys.engine.sources`): what a request ships is what it shipped before."""

from nnsight.intervention import serialization

from vlenvoys.engine.sources import install

SCALE = 2


def scaled(x):
    return x * SCALE


def shipped(function):
    """``function`` as a worker gets it: pickled by nnsight's serialization and loaded back."""
    return serialization.loads(serialization.dumps(function))


def test_a_function_ships_its_current_globals_and_closure():
    global SCALE
    install()
    install()  # once per process, however often it is called
    assert shipped(scaled)(3) == 6
    SCALE = 5  # the source is kept; the values it names are read at each pickling
    try:
        assert shipped(scaled)(3) == 15
    finally:
        SCALE = 2
    for offset in (1, 10):
        add = lambda x: x + offset  # noqa: E731 (a lambda's source is found by parsing)
        assert shipped(add)(1) == 1 + offset


def test_two_functions_of_one_name_keep_their_own_sources():
    install()

    def make(kind):
        if kind == "square":
            def value(x):
                return x * x
        else:
            def value(x):
                return -x
        return value

    square, negative = make("square"), make("negative")
    assert (shipped(square)(4), shipped(negative)(4)) == (16, -4)
    assert (shipped(square)(3), shipped(negative)(3)) == (9, -3)  # from the caches
