/**
 * The pure view rules under Node's own test runner: `npm test`.
 * What may look like a success, what each state reads, and notification texts
 * that fit JupyterLab's 140 characters without losing the facts.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  CHECKPOINT_ON_DISK,
  FROZEN_IN_HOST_MEMORY,
  IGpuFracEvent,
  IKernelStatus,
  ILease
} from '../src/api';
import { EVENT_KINDS, KERNEL_STATES } from '../src/contract';
import { describeEvent, eventNoticeKind, formatAge } from '../src/format';
import { historyEntries } from '../src/history';
import {
  askedFor,
  computeLine,
  freezingLine,
  leaseStateWords,
  recoveryPointLine,
  stateKept,
  unprotectedLine,
  writingLine
} from '../src/lease';
import { shareRange, usageOfRequest, usageOfShare } from '../src/memory';
import {
  eventNotice,
  frozenNotice,
  MAX_NOTICE,
  moveNotice,
  restoredNotice,
  thawedNotice
} from '../src/notices';
import { restoreAdvice, restoreFactsOf, restoreSummary } from '../src/restore';
import {
  configProblemsHeading,
  configProblemsNotice,
  DEFAULT_SETTINGS,
  readSettings
} from '../src/settings';
import {
  countdownLabel,
  isChanging,
  isTransitional,
  stateView
} from '../src/stateView';
import { statusDescription, statusLabel } from '../src/statusText';
import { defaultTrans, ITrans } from '../src/trans';
import { codePieces, fitWords, plainText } from '../src/words';

const NOW = 1_763_760_000;

const GPU1 = {
  uuid: 'GPU-1',
  index: 1,
  name: 'Simulated 16GiB',
  simulated: true
};

function status(
  state: string,
  extra: Partial<IKernelStatus> = {}
): IKernelStatus {
  return {
    kernel_id: 'k1',
    state,
    reason: null,
    gpu: GPU1,
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
  assert.equal(incomplete.label, 'restored in part');
  // With the kernel's report, the label says what did not come back.
  const cut = stateView(
    'restore-incomplete',
    status('restore-incomplete', {
      restore: {
        ok: false,
        restored: ['a', 'b'],
        lost: [],
        interrupted_cell: '[4] time.sleep(40)',
        message: 'Moved.'
      }
    }),
    UP,
    NOW
  );
  assert.equal(cut.label, 'restored · 1 cell cut off');
  assert.deepEqual(cut.shortfall, ['1 cell cut off']);
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
    'moving'
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
  // What happened, in plain words: no "losses".
  assert.match(notice.message, /^train\.ipynb: Lost: gen; cell \[7\]/);
  assert.doesNotMatch(notice.message, /loss/i);
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
    'demo.ipynb: Moved from GPU 1 to GPU 0 to free GPU 1 for a job. 2 of 2 variables restored.'
  );
});

test('a notebook resumed elsewhere says from when and where, and what is not protected', () => {
  const event: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'restored',
    cause: 'resumed',
    ok: false,
    restored: ['model', 'opt'],
    lost: ['big'],
    message:
      'Resumed from cell [7] at 05:52:24 on node-a, GPU 0 (Tesla T4): restored 2 of 3 variables; not restored: big (not protected).',
    reason:
      'Resumed from the last checkpoint of its earlier kernel: its Jupyter server on node-a was stopped at 05:52:30; it ran on GPU 0 (Tesla T4, 15.0 GiB) there, and runs on GPU 1 (NVIDIA H100 80GB HBM3, 79.6 GiB) here.'
  };
  const notice = restoredNotice(event, 'work/train.ipynb');
  assert.equal(notice.type, 'warning');
  assert.ok(notice.message.length <= MAX_NOTICE, notice.message);
  assert.match(
    notice.message,
    /^train\.ipynb: Resumed from cell \[7\] at 05:52:24 on node-a, GPU 0 \(Tesla T4\): restored 2 of 3/
  );
  const whole = restoredNotice({ ...event, ok: true, lost: [] }, 'a.ipynb');
  assert.equal(whole.type, 'success');
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
  assert.match(notice.message, /^notebook\.ipynb: Lost: 12 variables/);
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
    "37% of the GPU's compute; share 0.25–0.5 of the compute (not enforced: no CUDA MPS)"
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

test('the node table says when freezing is off, and why, never when it is on', () => {
  assert.equal(freezingLine({ available: true, why: null }), null);
  assert.equal(freezingLine(null), null);
  assert.equal(freezingLine(undefined), null);
  const off = freezingLine({
    available: false,
    why: 'the CUDA driver has not answered cuCheckpointProcessLock(4242) within 40 s; freezing is off on this node until it does.'
  });
  assert.ok(off?.startsWith('Freezing is off on this node: the CUDA driver'));
  assert.ok(
    off?.includes(
      'until it does. A kernel parked or reclaimed here is checkpointed'
    )
  );
  assert.ok(!off?.includes('..'));
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

// -- the status bar item -------------------------------------------------------

const GiB = 1024 ** 3;
const MiB = 1024 ** 2;

function label(
  state: string,
  extra: Partial<IKernelStatus> = {},
  agent = UP,
  now = NOW
): string {
  const s = status(state, extra);
  return statusLabel(s, stateView(state, s, agent, now)).text;
}

test('usage against request in one unit, the one of the larger figure', () => {
  assert.equal(usageOfRequest(2.1 * GiB, 4 * GiB), '2.1/4.0 GiB');
  assert.equal(usageOfRequest(300 * MiB, 4 * GiB), '0.3/4.0 GiB');
  // Small but not nothing: a CUDA context alone is about 50 MiB.
  assert.equal(usageOfRequest(49 * MiB, 4 * GiB), '<0.1/4.0 GiB');
  // Nothing used reads "0", never "0.0" beside another's "<0.1".
  assert.equal(usageOfRequest(0, 4 * GiB), '0/4.0 GiB');
  assert.equal(usageOfRequest(0.2 * MiB, 512 * MiB), '<1/512 MiB');
  assert.equal(usageOfRequest(300 * MiB, 512 * MiB), '300/512 MiB');
  // Bursting past a small request: the unit follows the usage.
  assert.equal(usageOfRequest(1.5 * GiB, 512 * MiB), '1.5/0.5 GiB');
  assert.equal(usageOfRequest(120 * GiB, 141 * GiB), '120/141 GiB');
  assert.equal(usageOfRequest(null, 4 * GiB), '–/4.0 GiB');
  assert.equal(usageOfRequest(2 * GiB, null), '2.0 GiB');
});

test('the status item is numeric, with a word only when there is news', () => {
  assert.equal(label('guaranteed', { usage: 2.1 * GiB }), 'GPU 1: 2.1/4.0 GiB');
  assert.equal(
    label('bursting', { usage: 5.2 * GiB }),
    'GPU 1: 5.2/4.0 GiB · bursting'
  );
  assert.equal(label('restored'), 'GPU 1: 1.0/4.0 GiB · restored');
  assert.equal(label('restore-incomplete'), 'GPU 1 · restored in part');
  assert.equal(
    label('restore-incomplete', {
      restore: {
        ok: false,
        restored: ['a'],
        lost: ['b', 'c'],
        interrupted_cell: '[4] train()',
        message: 'Moved.'
      }
    }),
    'GPU 1 · 2 variables lost'
  );
  // While the figures are changing the word alone: the tooltip has the last known ones.
  assert.equal(label('shrinking'), 'GPU 1 · shrinking');
  assert.equal(
    label('move-pending', { deadline: NOW + 23 }),
    'GPU 1 · moving in 23 s'
  );
  assert.equal(
    label('move-pending', { deadline: NOW - 1 }),
    'GPU 1 · moving now'
  );
  assert.equal(label('migrating'), 'GPU 1 · moving');
  assert.equal(label('oom-killed'), 'GPU 1 · stopped');
  // No lease, or no answer from the server: no GPU number to show.
  assert.equal(label('no-gpu', { gpu: null }), 'no GPU');
  assert.equal(
    statusLabel(null, stateView('unavailable', null, UP, NOW)).text,
    'GPU · unavailable'
  );
  assert.equal(
    statusLabel(null, stateView('unknown', null, UP, NOW)).text,
    'GPU: …'
  );
});

test('the status item never shows unverified figures as current', () => {
  // The agent down: any state, the usage is unknown ("?"), never "guaranteed".
  for (const state of ['guaranteed', 'bursting', 'restored', 'migrating']) {
    const s = status(state, { usage: 2.1 * GiB });
    const view = stateView(state, s, DOWN, NOW);
    const line = statusLabel(s, view);
    assert.equal(line.text, 'GPU 1: ? · agent unreachable', state);
    assert.equal(line.figures, '?');
    const text = statusDescription(s, view);
    assert.doesNotMatch(text.ariaLabel, /guaranteed/, state);
    assert.match(text.title, /^Last seen: 2\.1 GiB used, 4\.0 GiB requested/m);
    assert.match(text.title, /cannot be verified/);
  }
  // The server's own agent-unreachable state reads the same.
  assert.equal(label('agent-unreachable'), 'GPU 1: ? · agent unreachable');
  // Only states the agent vouches for show figures at all; after an
  // incomplete restore, what is missing takes their place.
  for (const state of KERNEL_STATES) {
    const s = status(state);
    const view = stateView(state, s, UP, NOW);
    const figures = statusLabel(s, view).figures;
    assert.equal(
      /\d/.test(figures),
      view.verified && state !== 'restore-incomplete',
      `${state}: ${JSON.stringify(figures)}`
    );
  }
});

test('the status item stays short; the tooltip has the device, limit and story', () => {
  // About 6.7 px a character at JupyterLab's 13 px UI font (the browser test
  // measures): the plain line within 20 characters, any line within 32.
  assert.ok(
    label('guaranteed', { usage: 12.5 * GiB, request: 16 * GiB }).length <= 20
  );
  for (const state of [...KERNEL_STATES, 'unknown', 'unavailable']) {
    for (const agent of [UP, DOWN]) {
      const s = status(state, {
        usage: 99.9 * GiB,
        request: 99.9 * GiB,
        deadline: NOW + 100,
        gpu: { uuid: 'GPU-7', index: 15, name: 'NVIDIA H100 80GB HBM3' }
      });
      const text = statusLabel(s, stateView(state, s, agent, NOW)).text;
      assert.ok(text.length <= 32, `${state}: ${text}`);
    }
  }
  const s = status('bursting', { usage: 5.2 * GiB });
  const { title, ariaLabel } = statusDescription(
    s,
    stateView('bursting', s, UP, NOW)
  );
  assert.equal(
    title,
    [
      'GPU 1 · 16GiB · simulated',
      '5.2 GiB used of 4.0 GiB guaranteed, 8.0 GiB limit.',
      'Bursting: Using loaned memory above its guaranteed share; it may be asked to give it back.',
      'Click for details.'
    ].join('\n')
  );
  assert.equal(
    ariaLabel,
    'GPU lease: GPU 1 · 16GiB · simulated, 5.2 GiB used of 4.0 GiB guaranteed, 8.0 GiB limit, bursting. Press Enter for details.'
  );
  // The countdown in full, with the reason, in the tooltip.
  const pending = status('move-pending', {
    deadline: NOW + 23,
    reason: 'A job needs GPU 1.'
  });
  assert.match(
    statusDescription(pending, stateView('move-pending', pending, UP, NOW))
      .title,
    /^Moving in 23 s — cell still running: .* A job needs GPU 1\.$/m
  );
});

test('settings: the defaults, and nothing out of range or unknown gets through', () => {
  assert.deepEqual(readSettings(null), DEFAULT_SETTINGS);
  assert.deepEqual(readSettings({}), {
    refreshInterval: 5000,
    statusItem: 'compact'
  });
  assert.deepEqual(
    readSettings({ refreshInterval: 15000, statusItem: 'full' }),
    { refreshInterval: 15000, statusItem: 'full' }
  );
  // The schema's minimum holds even where validation did not run.
  assert.equal(readSettings({ refreshInterval: 10 }).refreshInterval, 1000);
  assert.equal(readSettings({ refreshInterval: '3000' }).refreshInterval, 5000);
  assert.equal(readSettings({ refreshInterval: NaN }).refreshInterval, 5000);
  assert.equal(readSettings({ statusItem: 'huge' }).statusItem, 'compact');
});

test('the full status item: GPU name, usage/request/limit, and always the state', () => {
  const full = (state: string, extra: Partial<IKernelStatus> = {}) => {
    const s = status(state, {
      gpu: { uuid: 'GPU-1', index: 1, name: 'Tesla T4' },
      usage: 2.1 * GiB,
      ...extra
    });
    return statusLabel(s, stateView(state, s, UP, NOW), 'full').text;
  };
  assert.equal(full('guaranteed'), 'GPU 1 (T4): 2.1/4.0/8.0 GiB · guaranteed');
  assert.equal(full('bursting'), 'GPU 1 (T4): 2.1/4.0/8.0 GiB · bursting');
  assert.equal(
    full('guaranteed', { limit: null }),
    'GPU 1 (T4): 2.1/4.0 GiB · guaranteed'
  );
  // The same rules as compact: no figures while they change or are unverified.
  assert.equal(full('shrinking'), 'GPU 1 (T4) · shrinking');
  const s = status('guaranteed');
  assert.equal(
    statusLabel(s, stateView('guaranteed', s, DOWN, NOW), 'full').text,
    'GPU 1 (16GiB): ? · agent unreachable'
  );
  assert.equal(usageOfShare(300 * MiB, 512 * MiB, 2 * GiB), '0.3/0.5/2.0 GiB');
  assert.equal(usageOfShare(300 * MiB, 512 * MiB, null), '300/512 MiB');
});

test('the server settings problems: a notice that fits, a panel heading, the tooltip', () => {
  const problem =
    "c.GpuFrac.default_request: expected a fraction 0 < f <= 1 of one GPU, or a memory size like 2500M, 4G, 4Gi or bytes, got 'lots'";
  const one = configProblemsNotice([problem]);
  assert.ok(one.length <= MAX_NOTICE, one);
  assert.match(
    one,
    /^GPU setting problem: c\.GpuFrac\.default_request: expected/
  );
  assert.ok(one.endsWith('…'));
  assert.equal(
    configProblemsNotice(['c.GpuFrac.default_limit: got -1']),
    'GPU setting problem: c.GpuFrac.default_limit: got -1'
  );
  assert.match(
    configProblemsNotice(['a', 'b']),
    /^GPU setting problems \(2\): a; b$/
  );
  assert.match(configProblemsHeading(1), /a problem: .* until it is fixed/);
  assert.match(
    configProblemsHeading(2),
    /have 2 problems: .* until they are fixed/
  );
  const s = status('no-gpu', { gpu: null });
  const { title } = statusDescription(s, stateView('no-gpu', s, UP, NOW), [
    problem
  ]);
  assert.match(
    title,
    /^Server setting problem: c\.GpuFrac\.default_request: .*'lots'$/m
  );
});

test('"Asked for" names where request and limit came from, when the server says', () => {
  const lease = {
    id: 'L1',
    kind: 'notebook',
    request: 8 * GiB,
    limit: 16 * GiB,
    request_spec: '0.5',
    limit_spec: '1',
    state: 'active'
  } as ILease;
  assert.equal(
    askedFor(lease, { request: 'kernelspec', limit: 'c.GpuFrac' }),
    'request 0.5 (from the kernelspec), limit 1 (from the c.GpuFrac default)'
  );
  assert.equal(
    askedFor(lease, { request: '%gpu request', limit: null }),
    'request 0.5 (from %gpu request in this notebook), limit 1'
  );
  // An older server, or a lease older than the server process: the specs alone.
  assert.equal(askedFor(lease, undefined), 'request 0.5, limit 1');
  assert.equal(
    askedFor({ ...lease, limit_spec: undefined }, null),
    'request 0.5, limit 0.5'
  );
  assert.equal(askedFor(null, { request: 'kernelspec' }), null);
  assert.equal(
    askedFor(
      { ...lease, request_spec: undefined, limit_spec: undefined },
      null
    ),
    null
  );
});

test('every word goes through the translator; the default keeps English and counts', () => {
  // A bundle that marks what it translated: anything unmarked was missed.
  const mark = (text: string) => `«${text}»`;
  const fmt = (text: string, args: Array<string | number>) =>
    text.replace(/%(\d+)/g, (_, i) => String(args[Number(i) - 1]));
  const marking: ITrans = {
    __: (msgid, ...args) => mark(fmt(msgid, args)),
    _n: (one, many, n, ...args) => mark(fmt(n === 1 ? one : many, [n, ...args]))
  };
  const s = status('bursting', { usage: 5.2 * GiB });
  const view = stateView('bursting', s, UP, NOW, marking);
  assert.equal(view.label, '«bursting»');
  assert.match(view.help, /^«Using loaned memory/);
  assert.equal(
    statusLabel(s, view, 'compact', marking).text,
    '«GPU 1»: 5.2/4.0 GiB · «bursting»'
  );
  const { title } = statusDescription(s, view, [], marking);
  for (const line of title.split('\n')) {
    assert.match(line, /«/, line);
  }
  assert.equal(
    describeEvent({ kernel_id: 'k', event: 'placed', gpu_index: 0 }, marking),
    '«Placed on GPU 0.»'
  );
  const notice = restoredNotice(
    { kernel_id: 'k', event: 'restored', restored: ['a'], lost: ['b'] },
    'demo.ipynb',
    MAX_NOTICE,
    marking
  );
  assert.match(notice.message, /^demo\.ipynb: «1 of 2 variables restored»/);
  // The default: English as written, plurals by count, %1 the count.
  assert.equal(defaultTrans.__('%1 of %2', 'a', 'b'), 'a of b');
  assert.equal(defaultTrans._n('%1 file', '%1 files', 1), '1 file');
  assert.equal(defaultTrans._n('%1 file', '%1 files', 2), '2 files');
  // "%gpu" is no placeholder, and an argument's text is never re-read.
  assert.equal(defaultTrans.__('run %gpu on %1', '%2'), 'run %gpu on %2');
  assert.equal(
    restoreSummary({ ok: true, restored: ['a'], lost: [] }),
    '1 of 1 variable restored'
  );
});

// -- frozen kernels ------------------------------------------------------------

const FROZEN_MESSAGE =
  'Frozen because job "train.py" (l-3f9a2c) needs GPU 0 whole: its process and variables wait in host memory (a running cell waits too), and it thaws when the job ends.';

function frozenLease(state: string, extra: Partial<ILease> = {}): ILease {
  return {
    id: 'l-1',
    kind: 'notebook',
    kernel_id: 'k1',
    request: 4 * GiB,
    limit: 8 * GiB,
    state,
    frozen: true,
    frozen_at: NOW - 60,
    frozen_bytes: 2 * GiB,
    frozen_gpus: ['GPU-1'],
    protection: FROZEN_IN_HOST_MEMORY,
    fallback: '',
    ...extra
  };
}

/** A kernel without a GPU (parked, or waiting), frozen or not. */
function noGpu(
  state: string,
  lease: ILease | null,
  extra: Partial<IKernelStatus> = {}
): IKernelStatus {
  return status(state, {
    gpu: null,
    usage: null,
    lease,
    protection: lease ? (lease.protection ?? CHECKPOINT_ON_DISK) : null,
    fallback: lease?.fallback || null,
    ...extra
  });
}

test('a freeze for someone else is a warning that stays and says the kernel is kept', () => {
  assert.ok((EVENT_KINDS as readonly string[]).includes('frozen'));
  const frozen: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'frozen',
    message: FROZEN_MESSAGE,
    reason: 'job "train.py" needs GPU 0 whole',
    protection: FROZEN_IN_HOST_MEMORY,
    frozen_bytes: 2 * GiB,
    gpu_index: 0
  };
  assert.deepEqual(eventNoticeKind(frozen), {
    type: 'warning',
    autoClose: false
  });
  // The server's sentence as it is; an older server's event still says kept.
  assert.equal(describeEvent(frozen), FROZEN_MESSAGE);
  const bare = describeEvent({ ...frozen, message: undefined });
  assert.match(bare, /^Frozen \(job "train\.py" needs GPU 0 whole\)/);
  assert.match(bare, /every variable are kept in host memory/);
  // Within 140 characters: the asides go first, the notebook and the facts stay.
  const notice = frozenNotice(FROZEN_MESSAGE, 'work/train.ipynb');
  assert.ok(notice.length <= MAX_NOTICE, notice);
  assert.equal(
    notice,
    'train.ipynb: Frozen because job "train.py" needs GPU 0 whole: its process and variables wait in host memory, and it thaws when the job ends.'
  );
  assert.equal(
    frozenNotice('Frozen: a job needs GPU 0.', 'a.ipynb'),
    'a.ipynb: Frozen: a job needs GPU 0.'
  );
  // A long cause never cuts off that everything is kept.
  const long = frozenNotice(
    `Frozen: ${'another notebook on GPU 0 took back the memory it lent, '.repeat(3)}. Its process and variables wait in host memory; it thaws by itself.`,
    'demo.ipynb'
  );
  assert.ok(long.length <= MAX_NOTICE, long);
  assert.ok(long.startsWith('demo.ipynb: Frozen: another notebook'), long);
  assert.ok(
    long.endsWith('Its process and every variable are kept in host memory.'),
    long
  );
  // The thaw is news, not worry; the other interventions keep their kinds.
  assert.deepEqual(
    eventNoticeKind({ kernel_id: 'k1', event: 'unparked', gpu_index: 0 }),
    { type: 'info', autoClose: 8000 }
  );
  assert.equal(
    eventNoticeKind({ ...frozen, event: 'oom_killed' })?.type,
    'error'
  );
  assert.deepEqual(eventNoticeKind({ ...frozen, event: 'shrink_requested' }), {
    type: 'warning',
    autoClose: 20000
  });
  assert.equal(
    eventNoticeKind({ ...frozen, event: 'migrating' })?.type,
    'in-progress'
  );
  for (const quiet of ['placed', 'bursting', 'no_gpu', 'parked']) {
    assert.equal(eventNoticeKind({ ...frozen, event: quiet }), null, quiet);
  }
});

test('a park by freezing, by restart, and the thaw read as what they are', () => {
  const parked: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'parked',
    protection: FROZEN_IN_HOST_MEMORY
  };
  assert.match(describeEvent(parked), /^Parked: frozen in host memory/);
  assert.match(describeEvent(parked), /every variable kept/);
  assert.equal(
    describeEvent({ ...parked, protection: CHECKPOINT_ON_DISK }),
    'Parked: gave its GPU back while idle; the next cell gets one first.'
  );
  const thaw =
    'Back on GPU 0: thawed after 1 min 3 s frozen in host memory, with everything it held; nothing was restarted.';
  assert.equal(
    describeEvent({ kernel_id: 'k1', event: 'unparked', message: thaw }),
    thaw
  );
});

test('a parked kernel that is frozen says so on the chip, in the tooltip and the panel', () => {
  const frozen = noGpu('parked', frozenLease('parked'), { frozen_on: GPU1 });
  const view = stateView('parked', frozen, UP, NOW);
  assert.equal(view.hold, 'frozen');
  assert.equal(view.label, 'parked, frozen');
  assert.equal(view.severity, 'info');
  // Not "Idle": a park may be the user's own, and the reason says which.
  assert.match(view.help, /^Frozen in host memory: /);
  assert.doesNotMatch(view.help, /\bidle\b|\bdriver\b/i);
  assert.match(view.help, /Its next cell thaws it/);
  // It holds no GPU, and waits for the one it was frozen on.
  assert.equal(statusLabel(frozen, view).text, 'GPU 1 · parked, frozen');
  assert.equal(
    statusLabel(frozen, view, 'full').text,
    'GPU 1 (16GiB) · parked, frozen'
  );
  assert.match(
    statusDescription(frozen, view).title,
    /^Kept by: frozen in host memory \(2\.0 GiB of GPU memory\)\.$/m
  );
  // Parked by a restart: no "frozen" anywhere on the chip.
  const restarted = noGpu(
    'parked',
    frozenLease('parked', {
      frozen: false,
      frozen_at: null,
      frozen_bytes: 0,
      protection: CHECKPOINT_ON_DISK
    })
  );
  const plain = stateView('parked', restarted, UP, NOW);
  assert.equal(plain.hold, null);
  assert.equal(statusLabel(restarted, plain).text, 'GPU parked');
  assert.match(
    statusDescription(restarted, plain).title,
    /^Kept by: checkpoint on disk\.$/m
  );
  // The event's protection is enough before the next fetch brings the lease.
  const heard = noGpu('parked', null, { protection: FROZEN_IN_HOST_MEMORY });
  assert.equal(
    statusLabel(heard, stateView('parked', heard, UP, NOW)).text,
    'GPU parked, frozen'
  );
  // The agent down: nothing is claimed about the freeze.
  const down = stateView('parked', frozen, DOWN, NOW);
  assert.equal(down.hold, null);
  assert.doesNotMatch(statusLabel(frozen, down).text, /frozen/);
});

test('a kernel frozen for a job waits for a GPU; freezing and thawing are brief', () => {
  const waiting = noGpu('waiting-for-gpu', frozenLease('pending'), {
    frozen_on: GPU1
  });
  const view = stateView('waiting-for-gpu', waiting, UP, NOW);
  assert.equal(view.label, 'frozen, waiting for a GPU');
  assert.equal(view.severity, 'warning');
  assert.match(view.help, /thaws by itself once a GPU has room/);
  // The GPU it waits for is named (never "GPU · waiting · frozen").
  assert.equal(statusLabel(waiting, view).text, 'GPU 1 · frozen, waiting');
  // A waiting kernel not frozen holds no GPU and waits for any.
  const cold = noGpu('waiting-for-gpu', null);
  assert.equal(
    statusLabel(cold, stateView('waiting-for-gpu', cold, UP, NOW)).text,
    'waiting for a GPU'
  );
  const thawing = noGpu('waiting-for-gpu', frozenLease('thawing'));
  const thawView = stateView('waiting-for-gpu', thawing, UP, NOW);
  assert.equal(thawView.hold, 'thawing');
  assert.equal(statusLabel(thawing, thawView).text, 'GPU thawing');
  assert.equal(thawView.severity, 'info');
  assert.equal(isChanging(thawView), true);
  const freezing = noGpu('parked', frozenLease('freezing', { frozen: false }));
  const freezeView = stateView('parked', freezing, UP, NOW);
  assert.equal(statusLabel(freezing, freezeView).text, 'GPU freezing');
  assert.match(freezeView.help, /^Being frozen/);
  assert.equal(isChanging(freezeView), true);
  assert.equal(isChanging(view), false);
  assert.equal(
    isChanging(stateView('migrating', status('migrating'), UP, NOW)),
    true
  );
  // Within the status bar's 32 characters, with a two-digit GPU too.
  for (const s of [waiting, thawing, freezing]) {
    const wide = { ...s, gpu: { uuid: 'GPU-7', index: 15, name: 'H100' } };
    const text = statusLabel(wide, stateView(s.state, wide, UP, NOW)).text;
    assert.ok(text.length <= 32, text);
  }
});

test('the panel says what keeps the state, and why freezing could not be used', () => {
  assert.equal(
    stateKept(noGpu('parked', frozenLease('parked', { frozen_bytes: 0 }))),
    'frozen in host memory'
  );
  assert.equal(
    stateKept(noGpu('parked', frozenLease('parked'))),
    'frozen in host memory (2.0 GiB of GPU memory)'
  );
  const onDisk = status('guaranteed', {
    lease: frozenLease('active', { frozen: false, frozen_bytes: 0 }),
    protection: CHECKPOINT_ON_DISK,
    fallback: null
  });
  assert.equal(stateKept(onDisk), 'checkpoint on disk');
  assert.equal(
    stateKept({
      ...onDisk,
      fallback: 'the driver has no checkpoint API (CUDA 12.4 or newer needed).'
    }),
    'checkpoint on disk (freezing could not be used: the driver has no checkpoint API (CUDA 12.4 or newer needed))'
  );
  // No lease (or an older server): nothing to say.
  assert.equal(stateKept(status('no-gpu', { protection: null })), null);
  assert.equal(stateKept(status('guaranteed')), null);
  assert.equal(stateKept(null), null);
  // On its GPU the tooltip stays as it was: the panel has the line.
  assert.doesNotMatch(
    statusDescription(onDisk, stateView('guaranteed', onDisk, UP, NOW)).title,
    /State kept/
  );
});

test('the node table words freezing, thawing and frozen leases', () => {
  assert.equal(leaseStateWords(frozenLease('freezing')), 'freezing');
  assert.equal(leaseStateWords(frozenLease('thawing')), 'thawing');
  assert.equal(
    leaseStateWords(frozenLease('parked')),
    'parked, frozen in host memory'
  );
  assert.equal(
    leaseStateWords(frozenLease('pending')),
    'waiting for a GPU, frozen in host memory'
  );
  assert.equal(
    leaseStateWords(frozenLease('active', { frozen: false })),
    'guaranteed'
  );
  assert.equal(leaseStateWords(frozenLease('odd', { frozen: false })), 'odd');
});

test('the frozen words go through the translator', () => {
  const mark = (text: string) => `«${text}»`;
  const fmt = (text: string, args: Array<string | number>) =>
    text.replace(/%(\d+)/g, (_, i) => String(args[Number(i) - 1]));
  const marking: ITrans = {
    __: (msgid, ...args) => mark(fmt(msgid, args)),
    _n: (one, many, n, ...args) => mark(fmt(n === 1 ? one : many, [n, ...args]))
  };
  const frozen = noGpu('parked', frozenLease('parked'));
  const view = stateView('parked', frozen, UP, NOW, marking);
  assert.equal(view.label, '«parked, frozen»');
  assert.match(view.help, /^«Frozen in host memory/);
  assert.equal(
    statusLabel(frozen, view, 'compact', marking).text,
    '«GPU «parked, frozen»»'
  );
  assert.match(stateKept(frozen, marking) ?? '', /«frozen in host memory»/);
  assert.equal(leaseStateWords(frozenLease('thawing'), marking), '«thawing»');
  assert.match(
    describeEvent({ kernel_id: 'k', event: 'frozen' }, marking),
    /^«Frozen/
  );
});

test('the recovery point says which cell a restart restores, aged when shown', () => {
  const point = {
    durable_cell: 5,
    durable_time: 1000,
    unprotected: {},
    unprotected_why: null
  };
  assert.equal(recoveryPointLine(point, 1012), 'after cell [5], 12 s ago');
  // The same answer shown later is older: the server sends a time, not an age.
  assert.equal(
    recoveryPointLine(point, 1000 + 185),
    'after cell [5], 3 min ago'
  );
  assert.equal(
    recoveryPointLine(point, 1000 + 7500),
    'after cell [5], 2 h 5 min ago'
  );
  assert.equal(
    recoveryPointLine({ ...point, durable_cell: null }, 1030),
    '30 s ago'
  );
  assert.equal(recoveryPointLine(null, 1000), null);
  assert.equal(recoveryPointLine(undefined, 1000), null);
  assert.equal(unprotectedLine(point), null);
});

test('unprotected variables are named, largest first, with why', () => {
  const why =
    'over the per-kernel checkpoint budget of 1.0 GiB; raise ' +
    'c.GpuFrac.checkpoint_kernel_budget or delete variables you no longer need';
  const point = {
    durable_cell: 3,
    durable_time: 1000,
    unprotected: { small: 2 * 1024 ** 3, big_tensor: 4 * 1024 ** 3 },
    unprotected_why: why
  };
  assert.equal(
    unprotectedLine(point),
    `big_tensor (4.0 GiB), small (2.0 GiB) — ${why}`
  );
  assert.equal(
    unprotectedLine({ ...point, unprotected_why: null }),
    'big_tensor (4.0 GiB), small (2.0 GiB)'
  );
});

test('a write in progress is shown with its progress, and only when known', () => {
  const point = {
    durable_cell: 5,
    durable_time: 1000,
    unprotected: {},
    writing: { cell: 6, bytes_done: 1024 ** 3, bytes_total: 4 * 1024 ** 3 }
  };
  assert.equal(writingLine(point), 'after cell [6]: 1.0 GiB of 4.0 GiB');
  assert.equal(
    writingLine({
      ...point,
      writing: { ...point.writing, bytes_done: 0, queued: true }
    }),
    'after cell [6]: queued, 4.0 GiB'
  );
  assert.equal(writingLine({ ...point, writing: null }), null);
  assert.equal(
    writingLine({ durable_cell: 5, durable_time: 1000, unprotected: {} }),
    null
  );
});
test('a share of one size reads once: "16.0 GiB", not "16.0 GiB–16.0 GiB"', () => {
  const GiB = 1024 ** 3;
  assert.equal(shareRange(16 * GiB, 16 * GiB), '16.0 GiB');
  assert.equal(shareRange(4 * GiB, 16 * GiB), '4.0 GiB–16.0 GiB');
  assert.equal(shareRange(4 * GiB, null), '4.0 GiB');
});

test('a pending move counts down in the right tense, its countdown never cut', () => {
  const event: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'move_pending',
    to_gpu_index: 0,
    deadline: NOW + 30,
    reason:
      'to free GPU 1 for job "sleep 300" (l-1bd544f2429e), which needs the whole GPU and asked for it a while ago',
    message: 'Will move from GPU 1 to GPU 0 in 30 s (…); the running cell …'
  };
  const first = moveNotice(event, 'work/demo.ipynb', NOW + 2);
  assert.match(
    first,
    /^demo\.ipynb: Moving to GPU 0 in 28 s, sooner if the running cell ends: to free GPU 1/
  );
  assert.ok(first.length <= MAX_NOTICE, first);
  assert.match(moveNotice(event, 'demo.ipynb', NOW + 3), /in 27 s/);
  assert.match(
    moveNotice(event, 'demo.ipynb', NOW + 31),
    /^demo\.ipynb: Moving to GPU 0 now; the running cell is cut off/
  );
  assert.doesNotMatch(first, /Will move/);
});

test('one history entry per intervention: a move and its restore read as one', () => {
  const at = (event: string, time: number): IGpuFracEvent => ({
    kernel_id: 'k1',
    event,
    time,
    message: event
  });
  const entries = historyEntries([
    at('placed', 1),
    at('move_pending', 2),
    at('migrating', 3),
    at('migrated', 4),
    at('restored', 5),
    at('parked', 6),
    at('unparked', 7)
  ]);
  assert.deepEqual(
    entries.map(e => [e.event.event, e.steps.map(step => step.event)]),
    [
      ['placed', ['placed']],
      ['restored', ['move_pending', 'migrating', 'migrated', 'restored']],
      ['parked', ['parked']],
      ['unparked', ['unparked']]
    ]
  );
});

test('where a share came from, in words: this notebook, remembered, default', () => {
  const lease = {
    id: 'l-1',
    kind: 'notebook',
    request: 1,
    limit: 2,
    state: 'active',
    request_spec: '0.9',
    limit_spec: '1'
  } as ILease;
  assert.equal(
    askedFor(lease, {
      request: 'your last %gpu request here',
      limit: 'c.GpuFrac'
    }),
    'request 0.9 (from your request remembered here), limit 1 (from the c.GpuFrac default)'
  );
});

test('no "losses" in any word a user reads after a restore', () => {
  const event: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'restored',
    ok: false,
    restored: ['a', 'b'],
    lost: [],
    interrupted_cell: '[4] time.sleep(40)',
    message: 'Moved from GPU 1 to GPU 0; 2 of 2 variables restored.'
  };
  const notice = restoredNotice(event, 'demo.ipynb');
  assert.equal(
    notice.message,
    'demo.ipynb: 2 of 2 variables restored; cell [4] time.sleep(40) was cut off. Re-run it.'
  );
  const s = status('restore-incomplete', {
    restore: { ...event, message: event.message ?? '' } as never
  });
  const view = stateView('restore-incomplete', s, UP, NOW);
  assert.equal(view.label, 'restored · 1 cell cut off');
  assert.equal(statusLabel(s, view).text, 'GPU 1 · 1 cell cut off');
  for (const text of [notice.message, view.label, view.help]) {
    assert.doesNotMatch(text, /loss/i, text);
  }
});

test('ages are computed when shown, from the event time', () => {
  assert.equal(formatAge(NOW - 55, NOW), '55 s ago');
  assert.equal(formatAge(NOW - 150, NOW), '2 min ago');
  assert.equal(formatAge(NOW - 2 * 3600, NOW), '2 h ago');
  const s = status('guaranteed', {
    last_event: {
      event: 'migrated',
      message: 'Moved from GPU 1 to GPU 0.',
      time: NOW - 30
    }
  });
  const view = stateView('guaranteed', s, UP, NOW);
  // The same status, shown 25 s later, is 25 s older.
  for (const [now, age] of [
    [NOW, '30 s ago'],
    [NOW + 25, '55 s ago']
  ] as const) {
    assert.match(
      statusDescription(s, view, [], defaultTrans, now).title,
      new RegExp(`^Last news, ${age}: Moved from GPU 1 to GPU 0\\.$`, 'm')
    );
  }
});

test('commands are code in the panel and plain in notifications, never literal backticks', () => {
  const said = "Parked at its user's request (`%gpu park`): frozen.";
  assert.equal(
    plainText(said),
    "Parked at its user's request (%gpu park): frozen."
  );
  assert.deepEqual(codePieces(said), [
    { text: "Parked at its user's request (", code: false },
    { text: '%gpu park', code: true },
    { text: '): frozen.', code: false }
  ]);
  assert.equal(
    eventNotice(said, 'work/a.ipynb'),
    "a.ipynb: Parked at its user's request (%gpu park): frozen."
  );
});

test('the lasting notification of a move keeps its cause, shortened rather than dropped', () => {
  const event: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'restored',
    ok: true,
    restored: ['a', 'b', 'c', 'd'],
    lost: [],
    reason:
      "Moved from GPU 1 to GPU 0 to free GPU 1 for job \"python3 -c import os, time; print('job on', os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(20)\""
  };
  const notice = restoredNotice(event, 'work/Untitled1.ipynb', MAX_NOTICE);
  assert.equal(notice.type, 'success');
  assert.ok(notice.message.length <= MAX_NOTICE, notice.message);
  assert.match(
    notice.message,
    /^Untitled1\.ipynb: Moved from GPU 1 to GPU 0 to free GPU 1 for job /
  );
  assert.match(notice.message, /… 4 of 4 variables restored\.$/);
});

test('a countdown says where to and what for, never the move in the past tense', () => {
  const event: IGpuFracEvent = {
    kernel_id: 'k1',
    event: 'move_pending',
    to_gpu_index: 0,
    deadline: NOW + 30,
    reason: 'moved from GPU 1 to GPU 0 to free GPU 1 for a job'
  };
  assert.equal(
    moveNotice(event, 'a.ipynb', NOW),
    'a.ipynb: Moving to GPU 0 in 30 s, sooner if the running cell ends: to free GPU 1 for a job.'
  );
});

test('a thaw ends its freeze notification saying why it was frozen', () => {
  const text = thawedNotice(
    'Back on GPU 0: thawed after being frozen for under 1 s in host memory, with everything it held; nothing was restarted.',
    'frozen because job "python3 -c print(1)" needs GPU 0 whole: its process and variables wait in host memory',
    'work/a.ipynb'
  );
  assert.ok(text.length <= MAX_NOTICE, text);
  assert.match(
    text,
    /^a\.ipynb: Back on GPU 0: thawed after being frozen for under 1 s in host memory\. /
  );
  assert.match(text, /It was frozen because job "python3 -c print\(1\)"/);
});

test('a restore that only cut a cell off says every variable came back', () => {
  const cut = status('restore-incomplete', {
    restore: {
      ok: false,
      restored: ['a', 'b', 'c', 'd', 'e'],
      lost: [],
      interrupted_cell: '[3] train()',
      message: 'Moved.'
    }
  });
  const view = stateView('restore-incomplete', cut, UP, NOW);
  assert.doesNotMatch(view.help, /not everything/);
  assert.match(view.help, /every variable came back as it was before the cell/);
  const lost = status('restore-incomplete', {
    restore: { ok: false, restored: ['a'], lost: ['g'], message: 'Moved.' }
  });
  assert.match(
    stateView('restore-incomplete', lost, UP, NOW).help,
    /not every variable came back/
  );
});

test('a thaw is news in the status item for half a minute, however short the freeze', () => {
  const thawed = status('guaranteed', {
    last_event: {
      event: 'unparked',
      message:
        'Back on GPU 1: thawed after being frozen for under 1 s in host memory, with everything it held; nothing was restarted.',
      time: NOW - 5
    }
  });
  const view = stateView('guaranteed', thawed, UP, NOW);
  assert.match(
    statusLabel(thawed, view, 'compact', defaultTrans, NOW).text,
    / · thawed$/
  );
  assert.doesNotMatch(
    statusLabel(thawed, view, 'compact', defaultTrans, NOW + 40).text,
    /thawed/
  );
  // A parked kernel's own cell getting a GPU is no news.
  const own = status('guaranteed', {
    last_event: {
      event: 'unparked',
      message: 'Back on GPU 1: a cell asked for a GPU, and it runs there.',
      time: NOW - 5
    }
  });
  assert.doesNotMatch(
    statusLabel(
      own,
      stateView('guaranteed', own, UP, NOW),
      'compact',
      defaultTrans,
      NOW
    ).text,
    /thawed/
  );
});
