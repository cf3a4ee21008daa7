from conftest import eval_step, flat, loss_fn, make_state

from fit import fit


def test_trains_on_digits(digits, tmp_path):
    x, y, xt, yt = digits
    state, history = fit(make_state(), (x, y), (xt, yt), loss_fn=loss_fn, eval_step=eval_step,
                         batch_size=64, num_epochs=2, workdir=str(tmp_path))
    assert history["eval/accuracy"][-1] > 0.5  # chance is 0.1
    assert flat(state.params).shape == flat(make_state().params).shape
