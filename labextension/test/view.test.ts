/**
 * The pure view rules (src/view.ts) under Node's own test runner: `npm test`.
 * What may look like a success, what each state reads, and notification texts
 * that fit JupyterLab's 140 characters without losing the facts.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { IGpuFracEvent, IKernelStatus, ILease } from '../src/api';
import { KERNEL_STATES } from '../src/contract';
import {
  computeLine,
  countdownLabel,
  eventNotice,
  fitWords,
  isTransitional,
  MAX_NOTICE,
  restoreAdvice,
  restoredNotice,
  restoreFactsOf,
  restoreSummary,
  stateView
} from '../src/view';

const NOW = 1_763_760_000;

function status(
  state: string,
  extra: Partial<IKernelStatus> = {}
): IKernelStatus {
  return {
    kernel_id: 'k1',
    state,
    reason: null,
    gpu: { uuid: 'GPU-1', index: 1, name: 'Simulated 16GiB', simulated: true },
    request: 4 * 1024 ** 3,
    limit: 8 * 1024 ** 3,
    usage: 1024 ** 3,
    ...extra
  };
}

const UP = { down: false, reason: null };
const DOWN = { down: true, reason: 'No GPU agent answers at /run/agent.sock.' };

test('only a verified restore is a success', () => {
  for (const state of [
    'guaranteed',
    'bursting',
    'move-pending',
    'migrating',
    'shrinking',
    'oom-killed',
    'restore-incomplete',
    'agent-unreachable',
    'no-gpu',
    'unknown',
    'unavailable'
  ]) {
    assert.equal(
      stateView(state, status(state), UP, NOW).success,
      false,
      state
    );
  }
  const restored = stateView('restored', status('restored'), UP, NOW);
  assert.equal(restored.success, true);
  assert.equal(restored.severity, 'success');
  const incomplete = stateView(
    'restore-incomplete',
    status('restore-incomplete'),
    UP,
    NOW
  );
  assert.equal(incomplete.label, 'restored with losses');
  assert.equal(incomplete.severity, 'warning');
});

test('move-pending counts down to the deadline; migrating only once it started', () => {
  const pending = stateView(
    'move-pending',
    status('move-pending', { deadline: NOW + 23 }),
    UP,
    NOW
  );
  assert.equal(pending.label, 'moving in 23 s — cell still running');
  assert.equal(pending.secondsLeft, 23);
  assert.equal(
    stateView(
      'move-pending',
      status('move-pending', { deadline: NOW + 23 }),
      UP,
      NOW + 1.5
    ).label,
    'moving in 22 s — cell still running'
  );
  assert.equal(countdownLabel(NOW - 2, NOW), 'moving now — cell still running');
  assert.doesNotMatch(pending.label, /migrating/);
  assert.equal(
    stateView('migrating', status('migrating'), UP, NOW).label,
    'migrating'
  );
});

test('without the agent nothing reads guaranteed, and the reason shows', () => {
  for (const state of [
    'guaranteed',
    'bursting',
    'restored',
    'migrating',
    'unknown'
  ]) {
    const view = stateView(state, status(state), DOWN, NOW);
    assert.equal(view.state, 'agent-unreachable', state);
    assert.equal(view.label, 'agent unreachable');
    assert.equal(view.verified, false);
    assert.equal(view.success, false);
    assert.equal(view.reason, DOWN.reason);
  }
  // The server's own state carries its reason.
  const server = stateView(
    'agent-unreachable',
    status('agent-unreachable', {
      reason: 'start it with `gpufrac-agent serve`'
    }),
    UP,
    NOW
  );
  assert.equal(server.verified, false);
  assert.equal(server.reason, 'start it with `gpufrac-agent serve`');
  // No lease, no share to verify; the server not answering is its own state.
  assert.equal(
    stateView('no-gpu', status('no-gpu'), DOWN, NOW).state,
    'no-gpu'
  );
  assert.equal(stateView('unavailable', null, DOWN, NOW).state, 'unavailable');
  assert.equal(
    stateView('guaranteed', status('guaranteed'), UP, NOW).verified,
    true
  );
});

test('transitional states are polled every second', () => {
  assert.deepEqual(
    ['move-pending', 'migrating', 'oom-killed', 'guaranteed', 'shrinking'].map(
      isTransitional
    ),
    [true, true, true, false, false]
  );
});

test('fitWords never cuts inside a word', () => {
  const text =
    'Will move from GPU 0 to GPU 1 in 30 s; the running cell may finish until then.';
  assert.equal(fitWords(text, 200), text);
  const cut = fitWords(text, 40);
  assert.ok(cut.length <= 40, cut);
  assert.ok(cut.endsWith('…'));
  assert.ok(text.startsWith(cut.slice(0, -1)), cut);
  assert.match(text.slice(cut.length - 1), /^[\s,;:]/);
});

const LOST_EVENT: IGpuFracEvent = {
  kernel_id: 'k1',
  event: 'restored',
  message:
    'Moved from GPU 1 to GPU 0 to free GPU 1 for a job; 2 of 3 variables restored; lost: gen; cell [7] for epoch in range(100): was cut off: re-run it.',
  reason: 'Moved from GPU 1 to GPU 0 to free GPU 1 for a job.',
  restored: ['model', 'opt'],
  lost: ['gen'],
  ok: false,
  interrupted_cell: '[7] for epoch in range(100):',
  notebook: 'work/train.ipynb',
  time: NOW
};

test('a restore that lost something is a warning naming notebook, losses, cell, to-do', () => {
  const notice = restoredNotice(LOST_EVENT, LOST_EVENT.notebook ?? null);
  assert.equal(notice.type, 'warning');
  assert.ok(notice.message.length <= MAX_NOTICE, notice.message);
  assert.match(notice.message, /^train\.ipynb: Restored with losses/);
  assert.match(notice.message, /lost: gen; cell \[7\]/);
  assert.match(
    notice.message,
    /cell \[7\] for epoch in[^;]* was cut off\. Re-run it and the cells that create the lost names\.$/
  );
  // Only the cell's first line may be shortened; the Details action opens the rest.
  assert.doesNotMatch(notice.message.replace(/\[7\][^;]*was cut off/, ''), /…/);
});

test('ok missing is not a success either', () => {
  const { ok: _ok, ...rest } = {
    ...LOST_EVENT,
    lost: [],
    interrupted_cell: undefined
  };
  void _ok;
  const notice = restoredNotice(rest as IGpuFracEvent, 'a.ipynb');
  assert.equal(notice.type, 'warning');
  assert.match(
    notice.message,
    /^a\.ipynb: Restored, not verified: 2 of 2 variables restored; run %gpu/
  );
});

test('a verified restore is a success with the cause when it fits', () => {
  const notice = restoredNotice(
    { ...LOST_EVENT, ok: true, lost: [], interrupted_cell: undefined },
    'demo.ipynb'
  );
  assert.equal(notice.type, 'success');
  assert.equal(
    notice.message,
    'demo.ipynb: 2 of 2 variables restored. Moved from GPU 1 to GPU 0 to free GPU 1 for a job.'
  );
});

test('long losses shrink to fit, keeping the notebook and the facts', () => {
  const lost = Array.from(
    { length: 12 },
    (_, i) => `some_long_variable_name_${i}`
  );
  const event: IGpuFracEvent = {
    ...LOST_EVENT,
    lost,
    interrupted_cell:
      '[12] for epoch, (features, labels) in enumerate(tqdm(train_loader, desc="training")):'
  };
  const notice = restoredNotice(
    event,
    'experiments/very/deep/path/to/notebook.ipynb'
  );
  assert.ok(notice.message.length <= MAX_NOTICE, notice.message);
  assert.match(notice.message, /^notebook\.ipynb: Restored with losses/);
  assert.match(notice.message, /lost: 12 variables/);
  assert.match(notice.message, /cell \[12\] [^ ]/);
  assert.match(
    notice.message,
    /was cut off\. Re-run it and the cells that create the lost names\.$/
  );
});

test('nothing reported is not "0 of 0 variables restored"', () => {
  const event: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'restored',
    ok: false,
    restored: [],
    lost: []
  };
  const notice = restoredNotice(event, 'demo.ipynb');
  assert.equal(notice.type, 'warning');
  assert.doesNotMatch(notice.message, /0 of 0/);
  assert.match(notice.message, /%gpu/);
});

test('the panel says what to do, with every lost name and why', () => {
  const facts = restoreFactsOf({
    ok: false,
    restored: ['model'],
    lost: ['gen', 'fh'],
    lost_reasons: { gen: "TypeError: cannot pickle 'generator' object" },
    interrupted_cell: '[7] train()',
    checkpoint_cell: 6,
    error: null,
    message: '…'
  });
  assert.equal(
    restoreSummary(facts, { reasons: true, advice: false }),
    "1 of 3 variables restored; lost: gen (TypeError: cannot pickle 'generator' object), fh; cell [7] train() was cut off"
  );
  assert.equal(
    restoreAdvice(facts),
    'Re-run cell [7] train(), then re-run the cells that create gen and fh.'
  );
  assert.equal(restoreAdvice({ ok: true, restored: ['a'], lost: [] }), '');
});

test('other notifications name the notebook and fit', () => {
  const text = eventNotice(
    'Will move from GPU 0 to GPU 1 in 30 s (a job needs a whole GPU); the running cell may finish until then, otherwise it is cut off and the kernel restarts from the state after the last completed cell.',
    'work/demo.ipynb'
  );
  assert.ok(
    text.startsWith('demo.ipynb: Will move from GPU 0 to GPU 1 in 30 s')
  );
  assert.ok(text.length <= MAX_NOTICE);
  assert.ok(text.endsWith('…'));
});

test('variables kept on disk are named with their size, never as a success', () => {
  const event: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'restored',
    ok: false,
    restored: ['xs', 'model'],
    lost: [],
    deferred: { big: 900 * 2 ** 20 },
    reason: 'Stopped by the GPU agent to return loaned memory.'
  };
  const notice = restoredNotice(event, 'demo.ipynb');
  assert.equal(notice.type, 'warning');
  assert.ok(notice.message.length <= MAX_NOTICE, notice.message);
  assert.match(
    notice.message,
    /^demo\.ipynb: Restored; kept on disk .*big \(900 MiB\)/
  );
  assert.match(notice.message, /%gpu restore/);
  const facts = restoreFactsOf(event);
  assert.equal(
    restoreSummary(facts, { advice: false }),
    '2 of 3 variables restored; kept on disk until there is room on the GPU: big (900 MiB)'
  );
  assert.match(
    restoreAdvice(facts),
    /^Run %gpu restore once there is room on the GPU to load big\.$/
  );
});

test('compute is shown against its share and says whether it holds', () => {
  const lease: ILease = {
    id: 'l-1',
    kind: 'notebook',
    request: 1,
    limit: 2,
    state: 'active',
    compute_request: 0.25,
    compute_limit: 0.5,
    compute_usage: 37
  };
  assert.equal(
    computeLine(lease, false),
    "37% of the GPU's SMs; share 0.25–0.5 of the compute (not enforced: no CUDA MPS)"
  );
  assert.equal(
    computeLine({ ...lease, compute_limit: 0.25, compute_usage: null }, true),
    'not sampled; share 0.25 of the compute (held by CUDA MPS)'
  );
  assert.equal(
    computeLine({ ...lease, compute_request: null, compute_usage: null }, true),
    null
  );
});

test('every kernel state of the contract has words and help; one is a success', () => {
  for (const state of KERNEL_STATES) {
    const view = stateView(state, status(state), null, NOW);
    assert.equal(view.state, state);
    assert.ok(view.label.length > 0, state);
    assert.ok(view.help.length > 0, `no help for ${state}`);
    // Only a restore the kernel verified may look like a success.
    assert.equal(view.success, state === 'restored', state);
  }
});
