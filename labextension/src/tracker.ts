/**
 * Follows the notebook (or console) the user is looking at, and tells the
 * model which kernel that is: the only one that does, so the status item
 * always shows the kernel of the notebook in front. The kernel behind a
 * panel changes when the user switches kernels; a migration restarts the
 * kernel under the same id, so the kernel's status changes are a hint to
 * fetch again.
 */
import { JupyterFrontEnd } from '@jupyterlab/application';
import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { IGpuFracEvent } from './api';
import { GpuFracModel } from './model';

/** Widgets with a kernel: notebook and console panels have a sessionContext. */
function sessionContextOf(widget: Widget | null): ISessionContext | null {
  const candidate = (widget as { sessionContext?: ISessionContext } | null)
    ?.sessionContext;
  return candidate && typeof candidate.kernelChanged?.connect === 'function'
    ? candidate
    : null;
}

/** Kernel statuses after which the server's picture has likely changed. */
const REFRESH_ON: ReadonlySet<Kernel.Status> = new Set<Kernel.Status>([
  'restarting',
  'autorestarting',
  'dead',
  'starting'
]);

export class CurrentKernelTracker {
  /**
   * @param keep - widgets that, when current, keep the last kernel followed
   *   (the details panel: looking at it must not make it lose its kernel).
   */
  constructor(
    private readonly _shell: JupyterFrontEnd.IShell,
    private readonly _model: GpuFracModel,
    private readonly _keep: (widget: Widget) => boolean = () => false
  ) {
    // ILabShell and Notebook 7's shell both provide currentChanged.
    this._shell.currentChanged?.connect((_, args) => {
      this._follow(args.newValue);
    });
    this._follow(this._shell.currentWidget);
    this._model.eventReceived.connect(this._onEvent, this);
  }

  /** Fired when a panel with a kernel becomes, or stops being, the current widget. */
  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  /**
   * True while the current widget has a kernel: a notebook whose kernel was
   * shut down has nothing to show (no leftover "GPU · parked").
   */
  get hasKernelPanel(): boolean {
    return this._active;
  }

  /** Tell the status bar when there is something, or nothing, to show. */
  private _updateActive(): void {
    const active = !!this._context?.session?.kernel;
    if (active !== this._active) {
      this._active = active;
      this._activeChanged.emit();
    }
  }

  /**
   * Bring the notebook (or console) of a kernel to the front, so that every
   * view follows it; false when no open panel has that kernel.
   */
  show(kernelId: string): boolean {
    for (const widget of this._shell.widgets('main')) {
      if (sessionContextOf(widget)?.session?.kernel?.id === kernelId) {
        this._shell.activateById(widget.id);
        this._follow(widget);
        return true;
      }
    }
    return false;
  }

  private _follow(widget: Widget | null): void {
    if (widget && this._keep(widget)) {
      return;
    }
    const next = sessionContextOf(widget);
    if (next === this._context) {
      return;
    }
    if (this._context) {
      this._context.kernelChanged.disconnect(this._onKernelChanged, this);
      this._context.statusChanged.disconnect(this._onStatusChanged, this);
      this._context.disposed.disconnect(this._onDisposed, this);
    }
    this._context = next;
    if (next) {
      next.kernelChanged.connect(this._onKernelChanged, this);
      next.statusChanged.connect(this._onStatusChanged, this);
      next.disposed.connect(this._onDisposed, this);
      this._model.kernelId = next.session?.kernel?.id ?? null;
      this._model.path = next.path;
    }
    // Without a kernel panel the model keeps the last kernel: the details
    // panel may still be open on it.
    this._updateActive();
  }

  /** The notebook was closed: its kernel is no longer ours to show. */
  private _onDisposed(context: ISessionContext): void {
    const id = context.session?.kernel?.id ?? null;
    if (this._context === context) {
      this._follow(null);
    }
    if (id === null || id === this._model.kernelId) {
      this._model.kernelId = null;
      this._model.path = '';
    }
  }

  /**
   * After the server restarted a kernel behind the page's back (a move, an OOM
   * kill), JupyterLab only heard the new kernel say "starting" and shows that
   * until the next request. A request makes the kernel announce busy, then
   * idle. It must be a tracked one: JupyterLab ignores status messages caused
   * by kernel_info requests (`untracked_message_types`); is_complete is cheap
   * and has no side effects.
   */
  private _onEvent(_: GpuFracModel, event: IGpuFracEvent): void {
    const kernel = this._context?.session?.kernel;
    if (
      kernel &&
      kernel.id === event.kernel_id &&
      (event.event === 'restored' || event.event === 'migrated') &&
      kernel.status === 'starting'
    ) {
      kernel.requestIsComplete({ code: '' }).catch(() => undefined);
    }
  }

  private _onKernelChanged(context: ISessionContext): void {
    this._model.kernelId = context.session?.kernel?.id ?? null;
    this._model.path = context.path;
    this._updateActive();
  }

  private _onStatusChanged(
    context: ISessionContext,
    status: Kernel.Status
  ): void {
    // The kernel id is known only once the session has one.
    const id = context.session?.kernel?.id ?? null;
    if (id !== this._model.kernelId) {
      this._model.kernelId = id;
      this._model.path = context.path;
    } else if (
      REFRESH_ON.has(status) ||
      (status === 'idle' && this._lastStatus !== 'idle')
    ) {
      // A (re)start may mean a move; a finished cell may have changed usage.
      void this._model.refresh();
    }
    this._lastStatus = status;
    this._updateActive();
  }

  private _context: ISessionContext | null = null;
  private _active = false;
  private _lastStatus: Kernel.Status | null = null;
  private _activeChanged = new Signal<this, void>(this);
}
