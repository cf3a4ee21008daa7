"""The classic template CNN (Conv, BatchNorm, ReLU, pooling, twice; Dropout; Dense) trained with fit.py.

    python examples/mnist.py                    # scikit-learn's bundled 8x8 digits: no download
    python examples/mnist.py --dataset mnist    # MNIST through tensorflow_datasets (downloads once)
    tensorboard --logdir logs                   # then open http://localhost:6006

By default it trains on the 1797 8x8 handwritten digits that ship with scikit-learn, holding out
the last 357 as a fixed test set, and finishes in about a minute on 2 CPU cores. With `--check`
it exits non-zero if the final test accuracy is below 0.97.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's fit.py

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fit import TrainState, fit, lr_schedule  # noqa: E402

TARGET_ACCURACY = 0.97


class CNN(nn.Module):
    """Two blocks of 3x3 conv, BatchNorm, ReLU and 2x2 average pooling, then Dropout and Dense."""

    @nn.compact
    def __call__(self, x, train):
        for features in (32, 64):
            x = nn.Conv(features, (3, 3))(x)
            # momentum 0.9, not flax's default 0.99: a short run leaves 0.99's running statistics
            # far from the data, and inference mode (eval) then scores much worse than training.
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(10)(x)


def load_digits():
    """scikit-learn's 8x8 digits as float32 images in [0, 1]; the last 357 are the test set."""
    from sklearn.datasets import load_digits as sklearn_digits
    d = sklearn_digits()
    x = (d.images[..., None] / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    return (x[:-357], y[:-357]), (x[-357:], y[-357:])


def load_mnist():
    """MNIST's 60000/10000 split through tfds.data_source (no TensorFlow needed; downloads once)."""
    import tensorflow_datasets as tfds

    def arrays(split):
        ds = tfds.data_source("mnist", split=split)
        examples = [ds[i] for i in range(len(ds))]
        x = np.stack([e["image"] for e in examples]).astype(np.float32) / 255.0
        y = np.array([e["label"] for e in examples], np.int32)
        return x, y
    return arrays("train"), arrays("test")


def loss_fn(logits, labels):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"loss": loss, "accuracy": (logits.argmax(-1) == labels).mean()}


def eval_step(state, batch):
    x, y = batch
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, x, train=False)
    return (logits.argmax(-1) == y).mean()  # logged as eval/accuracy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=("digits", "mnist"), default="digits")
    parser.add_argument("--epochs", type=int, help="default: 40 for digits, 3 for mnist")
    parser.add_argument("--batch-size", type=int, help="default: 32 for digits, 128 for mnist")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights, shuffling and dropout")
    parser.add_argument("--workdir", default=os.getcwd(),
                        help="logs go to <workdir>/logs, checkpoints to <workdir>/checkpoints")
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if the final test accuracy is below {TARGET_ACCURACY}")
    args = parser.parse_args(argv)
    digits = args.dataset == "digits"
    args.epochs = args.epochs or (40 if digits else 3)
    args.batch_size = args.batch_size or (32 if digits else 128)

    (x, y), (x_test, y_test) = load_digits() if digits else load_mnist()
    print(f"{args.dataset}: {len(x)} train and {len(x_test)} test images of shape {x.shape[1:]}")

    model = CNN()
    variables = model.init(jax.random.key(args.seed), x[:1], train=False)
    # fit batches arrays with a smaller last batch, so an epoch is ceil(n / batch_size) steps.
    steps_per_epoch = math.ceil(len(x) / args.batch_size)
    lr_fn = lr_schedule(base_lr=args.lr, steps_per_epoch=steps_per_epoch, epochs=args.epochs,
                        warmup_epochs=min(1, args.epochs - 1))
    state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                              batch_stats=variables["batch_stats"],
                              tx=optax.inject_hyperparams(optax.adam)(lr_fn))

    state, history = fit(state, (x, y), (x_test, y_test), loss_fn=loss_fn, eval_step=eval_step,
                         batch_size=args.batch_size, num_epochs=args.epochs,
                         log_name=args.dataset, workdir=args.workdir, seed=args.seed,
                         hparams={"lr": args.lr, "dataset": args.dataset})

    accuracy = history["eval/accuracy"][-1]
    logs = os.path.join(os.path.abspath(args.workdir), "logs")
    print(f"final test accuracy: {accuracy:.4f}")
    print(f"TensorBoard logs:    {history.log_dir}")
    print(f"checkpoints:         {history.ckpt_dir}  (restore with fit.load_ckpt(state, ckpt_dir))")
    print(f"view the runs with:  tensorboard --logdir {logs}")
    if args.check and accuracy < TARGET_ACCURACY:
        print(f"FAILED: test accuracy {accuracy:.4f} is below {TARGET_ACCURACY}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
