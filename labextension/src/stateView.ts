/**
 * Which state a kernel is shown in, in which words and colour, and whether it
 * may look like a success: what the status item and the panel both show.
 */
import { FROZEN_IN_HOST_MEMORY, IKernelStatus } from './api';
import { KERNEL_STATE_WORDS } from './contract';
import {
  deferredNames,
  IRestoreFacts,
  restoreFactsOf,
  restoreShortfall,
  unreported
} from './restore';
import { defaultTrans, ITrans } from './trans';

/** How worried to be; drives the badge colour together with data-state. */
export type Severity = 'plain' | 'success' | 'info' | 'warning' | 'error';

/** What the agent's reachability signals say, newest first (see model.ts). */
export interface IAgentHealth {
  down: boolean;
  /** The reason text people read while it is down. */
  reason: string | null;
}

/**
 * The driver's part while a kernel has no GPU (DESIGN.md "freeze / thaw"):
 * its process frozen, every variable kept in host memory; or on the way
 * there or back.
 */
export type Hold = 'frozen' | 'freezing' | 'thawing';

/** Everything the status item and the panel need to show the state. */
export interface IStateView {
  /** The state shown (data-state): the server's, unless the agent is down. */
  state: string;
  /** Parked or waiting for a GPU: whether it is frozen (or freezing, thawing). */
  hold: Hold | null;
  /** The badge words: "guaranteed", "moving in 23 s — cell still running". */
  label: string;
  /** One sentence explaining the state. */
  help: string;
  /** The server's (or the agent health's) reason, or ''. */
  reason: string;
  severity: Severity;
  /** Whether the view may mark this as a success (green, tick). */
  success: boolean;
  /** Whether the usage figures are verified by the agent ("guaranteed"). */
  verified: boolean;
  /** Seconds left before a pending move cuts the running cell off. */
  secondsLeft: number | null;
  /** After an incomplete restore, what did not come back, most important first: ["2 variables lost", "1 cell cut off"]. */
  shortfall: string[];
}

// Built per call, not once: the words are in the user's language, and
// `trans.__('…')` with a literal is what the string extractor finds.
function helps(trans: ITrans): Record<string, string> {
  return {
    guaranteed: trans.__('Using no more than its guaranteed share.'),
    bursting: trans.__(
      'Using loaned memory above its guaranteed share; it may be asked to give it back.'
    ),
    shrinking: trans.__('Asked to give loaned memory back to its owner.'),
    'move-pending': trans.__(
      'The GPU agent asked for a move while a cell runs: the cell may finish until the countdown ends, otherwise it is cut off and the kernel restarts from the state after the last completed cell.'
    ),
    migrating: trans.__(
      'Being moved to another GPU now; its variables come back with it.'
    ),
    restored: trans.__(
      'Restarted by jupyter-gpufrac; every variable came back.'
    ),
    'restore-incomplete': trans.__(
      'Restarted by jupyter-gpufrac, but not everything came back: see what was lost and re-run the cells that make it.'
    ),
    'oom-killed': trans.__(
      'Stopped by the GPU agent, to give memory back or because a move did not finish in time (the reason says which); it restarts from the state after its last completed cell.'
    ),
    'agent-unreachable': trans.__(
      "The GPU agent does not answer, so this kernel's GPU share cannot be verified. Cells still run."
    ),
    'no-gpu': trans.__('This kernel holds no GPU lease.'),
    parked: trans.__(
      'It gave its GPU back (the reason says why); its variables are kept. The next cell gets a GPU first (maybe another one), then runs.'
    ),
    'waiting-for-gpu': trans.__(
      'A cell is waiting for a GPU with room for this kernel; it runs as soon as there is one. Interrupt the kernel to cancel.'
    ),
    unknown: trans.__(
      'The server has no GPU lease information for this kernel (yet).'
    ),
    unavailable: trans.__(
      'The jupyter-gpufrac server extension did not answer.'
    )
  };
}

// Keyed "<state>:<hold>"; a hold with no words of its own for a state reads
// as the hold alone ("freezing", "thawing").
function holdHelps(trans: ITrans): Record<string, string> {
  return {
    'parked:frozen': trans.__(
      'Frozen in host memory: its GPU memory waits there and the GPU was given back (the reason says why); the process runs on with every variable, open file and thread. Its next cell thaws it first, then runs.'
    ),
    'waiting-for-gpu:frozen': trans.__(
      'Frozen in host memory while its GPU is needed elsewhere: its process and every variable wait there (a running cell waits too), and it thaws by itself once a GPU has room. Nothing is restarted.'
    ),
    freezing: trans.__(
      'Being frozen: its GPU memory goes into host memory, then the GPU is given back. Nothing is restarted; every variable is kept.'
    ),
    thawing: trans.__(
      'Being thawed: its GPU memory comes back from host memory, then the waiting cell runs. Nothing was restarted; every variable is kept.'
    )
  };
}

function holdLabels(trans: ITrans): Record<string, string> {
  return {
    'parked:frozen': trans.__('parked, frozen'),
    'waiting-for-gpu:frozen': trans.__('frozen, waiting for a GPU'),
    freezing: trans.__('freezing'),
    thawing: trans.__('thawing')
  };
}

/** The words of `table` for a state with a hold, if it has any. */
export function holdWords(
  table: Record<string, string>,
  state: string,
  hold: Hold | null
): string | undefined {
  return hold ? (table[`${state}:${hold}`] ?? table[hold]) : undefined;
}

/**
 * The glossary's word for each state (docs/glossary.md), as `%gpu` says it:
 * the contract's words (generated, English) are msgids too. Not "OOM-killed"
 * but "stopped": the agent also stops a kernel whose move ran out of time.
 */
function labels(trans: ITrans): Record<string, string> {
  const words: Record<string, string> = {
    unavailable: trans.__('unavailable'),
    unknown: '…'
  };
  for (const [state, word] of Object.entries(KERNEL_STATE_WORDS)) {
    words[state] = trans.__(word);
  }
  return words;
}

/**
 * What an incomplete restore means, by what it lacks: never "not everything
 * came back" beside "restored 5 of 5 variables".
 */
function incompleteHelp(facts: IRestoreFacts, trans: ITrans): string {
  if (unreported(facts)) {
    return trans.__(
      'Restarted by jupyter-gpufrac; the kernel did not say what came back: run %gpu in the notebook to see.'
    );
  }
  if ((facts.lost ?? []).length) {
    return trans.__(
      'Restarted by jupyter-gpufrac; not every variable came back: re-run the cells that make the lost ones.'
    );
  }
  if (deferredNames(facts).length) {
    return trans.__(
      'Restarted by jupyter-gpufrac; some variables wait on disk until the GPU has room: %gpu restore loads them.'
    );
  }
  return trans.__(
    'Restarted by jupyter-gpufrac; every variable came back as it was before the cell that was cut off: re-run that cell.'
  );
}

const SEVERITY: Record<string, Severity> = {
  guaranteed: 'plain',
  bursting: 'warning',
  shrinking: 'warning',
  'move-pending': 'warning',
  migrating: 'info',
  restored: 'success',
  'restore-incomplete': 'warning',
  'oom-killed': 'error',
  'agent-unreachable': 'error',
  unavailable: 'error',
  'no-gpu': 'plain',
  parked: 'info',
  'waiting-for-gpu': 'warning',
  unknown: 'plain'
};

/**
 * The state to show. Without the agent nothing about the share is verified,
 * so every lease state reads "agent unreachable"; only "no GPU" (no share to
 * verify) and "unavailable" (the server itself did not answer) stay.
 */
export function effectiveState(
  state: string,
  agent: IAgentHealth | null
): string {
  if (agent?.down && state !== 'no-gpu' && state !== 'unavailable') {
    return 'agent-unreachable';
  }
  return state;
}

/** "moving in 23 s — cell still running"; "moving now" once the time is up. */
export function countdownLabel(
  deadline: number,
  nowSeconds: number,
  trans: ITrans = defaultTrans
): string {
  const left = Math.ceil(deadline - nowSeconds);
  return left > 0
    ? trans.__('moving in %1 s — cell still running', left)
    : trans.__('moving now — cell still running');
}

export function stateLabel(
  state: string,
  deadline?: number | null,
  nowSeconds: number = Date.now() / 1000,
  trans: ITrans = defaultTrans
): string {
  if (state === 'move-pending' && deadline) {
    return countdownLabel(deadline, nowSeconds, trans);
  }
  return labels(trans)[state] ?? state;
}

export function stateHelp(state: string, trans: ITrans = defaultTrans): string {
  return helps(trans)[state] ?? '';
}

/** Whether a state is on its way somewhere: worth asking the server every second. */
export function isTransitional(state: string): boolean {
  return ['move-pending', 'migrating', 'oom-killed'].includes(state);
}

/** As isTransitional, and also while the driver freezes or thaws the kernel. */
export function isChanging(view: Pick<IStateView, 'state' | 'hold'>): boolean {
  return (
    isTransitional(view.state) ||
    view.hold === 'freezing' ||
    view.hold === 'thawing'
  );
}

/**
 * Whether a kernel without a GPU (parked, or waiting for one) is frozen, or
 * being frozen or thawed: from its lease, or from the protection an event
 * just named (the model's guess until the next fetch). Null in any other
 * state: a kernel on its GPU holds nothing in host memory.
 */
export function holdOf(
  state: string,
  status: IKernelStatus | null
): Hold | null {
  if (state !== 'parked' && state !== 'waiting-for-gpu') {
    return null;
  }
  const leaseState = status?.lease?.state;
  if (leaseState === 'freezing' || leaseState === 'thawing') {
    return leaseState;
  }
  if (
    status?.lease?.frozen === true ||
    status?.protection === FROZEN_IN_HOST_MEMORY
  ) {
    return 'frozen';
  }
  return null;
}

/**
 * From what the model knows to what the views show.
 *
 * @param state - the server's state, or the model's local one
 *   ('unknown' / 'unavailable') when there is no status
 */
export function stateView(
  state: string,
  status: IKernelStatus | null,
  agent: IAgentHealth | null,
  nowSeconds: number = Date.now() / 1000,
  trans: ITrans = defaultTrans
): IStateView {
  const shown = effectiveState(state, agent);
  const overridden = shown !== state;
  const deadline = shown === 'move-pending' ? (status?.deadline ?? null) : null;
  let reason = overridden ? (agent?.reason ?? '') : (status?.reason ?? '');
  if (shown === 'agent-unreachable' && !reason) {
    reason = agent?.reason ?? '';
  }
  const hold = holdOf(shown, status);
  const facts =
    shown === 'restore-incomplete' && status?.restore
      ? restoreFactsOf(status.restore)
      : null;
  const shortfall = facts ? restoreShortfall(facts, trans) : [];
  return {
    state: shown,
    hold,
    label: shortfall.length
      ? trans.__('restored · %1', shortfall.join(', '))
      : (holdWords(holdLabels(trans), shown, hold) ??
        stateLabel(shown, deadline, nowSeconds, trans)),
    shortfall,
    help:
      holdWords(holdHelps(trans), shown, hold) ??
      (facts ? incompleteHelp(facts, trans) : stateHelp(shown, trans)),
    reason: reason.trim(),
    // Thawing is the way back: news, not worry.
    severity: hold === 'thawing' ? 'info' : (SEVERITY[shown] ?? 'plain'),
    // "restored" is the server's word for a restore the kernel verified.
    success: shown === 'restored',
    verified: [
      'guaranteed',
      'bursting',
      'restored',
      'restore-incomplete'
    ].includes(shown),
    secondsLeft:
      deadline !== null ? Math.max(0, Math.ceil(deadline - nowSeconds)) : null
  };
}
